"""The compiled form: memplan decides which forward values a torch.compile'd step recomputes, inductor fuses.

torch.compile's AOTAutograd traces each compiled region's forward and backward as one joint graph and its
min-cut partitioner decides what the forward saves for the backward. `joint.py` reads a joint graph into a
torch-free `JointGraph`; `partition.py` is a partitioner for inductor (`torch._inductor.config.
custom_partitioner_fn`) that asks a decision function which forward nodes to recompute, tags them
`MUST_RECOMPUTE` and lets the min-cut place the rest, so inductor compiles and fuses what memplan chose.
"""

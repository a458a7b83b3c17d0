"""The solvers' shared core (torch-free): the `Problem`, the one schedule simulator, `Solution` and its
options, the MILP backends, the portfolio check, and the helpers several solvers build on (checkpoint
fills, orders, peak insertion, coarsening, fixed variant choices, arena addresses, Checkmate's
rematerialization MILP). Solver modules in `tasks.solve` import from here and never from each other."""

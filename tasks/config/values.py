"""Values of `pipeline.toml` and the CLI: byte budgets (bytes, sizes with units, fractions of the
checkpoint-all peak or of eager PyTorch's measured peak), `--option KEY=VALUE` assignments, overhead
limits, and the names they are checked against."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
NAMED_LOSSES = ("cross_entropy", "mse", "causal_lm", "labels", "sum")
TRANSFORMERS_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification",
    "AutoModel",
)
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE]\d{1,4})?)\s*([A-Za-z]+)\s*$")     # exponents of 4 digits at most: sizes are exact
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")
_OF_EAGER = re.compile(r"^\s*(\S*?)\s*%\s*eager\s*$", re.IGNORECASE)
MAX_EAGER_FRACTION = 10.0
"""The largest fraction of eager's peak a budget may be ("1000% eager"): more is a typo."""


@dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, a fraction of the checkpoint-all peak (no recomputation), a fraction
    of eager PyTorch's measured peak for the model and batch size (`eager_fraction`, resolved to bytes by
    `of_eager` once the reference stage has measured that peak), or `max_overhead`: the least memory whose
    schedule's predicted cost is at most (1 + max_overhead) times the checkpoint-all schedule's (found by a
    search over budgets, `tasks.solve_stage.least_memory_within`)."""

    bytes: int | None = None
    fraction: float | None = None
    max_overhead: float | None = None
    eager_fraction: float | None = None

    @property
    def label(self) -> str:
        """Readable form used in plan aliases: `60pct`, `1610612736B`, `50pct-eager` or `ovh10pct`."""
        if self.max_overhead is not None:
            return f"ovh{self.max_overhead * 100:g}pct"
        if self.fraction is not None:
            return f"{self.fraction * 100:g}pct"
        if self.eager_fraction is not None:
            return f"{self.eager_fraction * 100:g}pct-eager"
        return f"{self.bytes}B"

    def of_eager(self, eager_peak_bytes: int) -> Budget:
        """This budget with a fraction of eager's peak resolved to bytes, given eager's measured peak; any
        other budget as it is."""
        if self.eager_fraction is None:
            return self
        return Budget(bytes=max(1, int(self.eager_fraction * eager_peak_bytes)))

    def resolve(self, checkpoint_all_peak_bytes: int) -> int:
        """Budget in bytes given the peak of the eager schedule that keeps every activation (an overhead
        limit starts its search there)."""
        if self.eager_fraction is not None:
            raise ValueError(f"budget {self.label} is a fraction of eager PyTorch's measured peak, which only the "
                             "pipeline measures (memplan run, its reference stage); give bytes or a fraction of the "
                             "checkpoint-all peak here instead")
        if self.max_overhead is not None:
            return int(checkpoint_all_peak_bytes)
        if self.fraction is not None:
            return int(self.fraction * checkpoint_all_peak_bytes)
        return int(self.bytes)


MAX_BUDGET_BYTES = 2**63 - 1
"""The largest budget in bytes: plans and the plans index store budgets as signed 64-bit integers."""


def parse_budget(value: Any) -> Budget:
    """Parse `2000000000` (bytes), `0.6` or `"60%"` (fraction of checkpoint-all), `"50% eager"` (fraction of
    eager PyTorch's measured peak, in (0, 10]), `"1.5 GiB"`."""
    if isinstance(value, bool):
        raise ValueError(_budget_help(value))
    if isinstance(value, int):
        if not 0 < value <= MAX_BUDGET_BYTES:
            raise ValueError(_budget_help(value))
        return Budget(bytes=value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(_budget_help(value))
        return Budget(fraction=value)
    if isinstance(value, str):
        if m := _OF_EAGER.match(value):
            return Budget(eager_fraction=_eager_fraction(value, m.group(1)))
        if m := _PERCENT.match(value):
            fraction = float(m.group(1)) / 100
            if 0.0 < fraction <= 1.0:
                return Budget(fraction=fraction)
        elif (m := _BYTES.match(value)) and m.group(2).lower() in _UNITS:
            nbytes = Fraction(Decimal(m.group(1))) * _UNITS[m.group(2).lower()]    # exact, unlike a float
            if 1 <= nbytes <= MAX_BUDGET_BYTES:             # "0.5 B" would be a 0-byte budget
                return Budget(bytes=int(nbytes))
    raise ValueError(_budget_help(value))


def parse_budget_text(text: str) -> Budget:
    """A budget written on the command line, read as the TOML value it would be in pipeline.toml:
    `2000000000` (bytes), `0.8` (fraction), `80%` or `1.5GiB` (a string without quotes)."""
    return parse_budget(_toml_value(text))


def parse_option_text(assignment: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line: VALUE read as a TOML value (`mode=memory` and `mode="memory"`
    are the same string, `keep=[1, 2]` a list, `gap=0.1` a float)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"option {assignment!r} is not KEY=VALUE (e.g. --option mode=memory).")
    return key.strip(), _toml_value(text.strip())


def _toml_value(text: str) -> Any:
    """`text` read as a TOML value (`0.8`, `[1, 2]`, `"x"`); text that is not one stays the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_device_memory(value: Any) -> int | str | None:
    """`device_memory`: bytes (an int, or a size with a unit such as `"16 GiB"`), `"device"` (what the GPU has
    free, read at run time) or none."""
    if value is None or value == "device":
        return value
    try:
        budget = parse_budget(value)
    except ValueError:
        budget = None
    if budget is None or budget.bytes is None:
        raise ValueError(
            f"device_memory {value!r} is not a size; write the device's memory as bytes (17179869184) or a size with "
            f"a unit ('16 GiB', '80 GB'; units {', '.join(_UNITS)}), or \"device\" to read what the GPU has free "
            f"(torch.cuda.mem_get_info), or leave the key out for no limit")
    return budget.bytes


MIN_DEVICE_MEMORY = 2**20
"""The least `device_memory` a run that may be on a GPU takes: PyTorch's CUDA allocator reserves at least 2 MiB
for a step's first tensor, so a smaller limit is a unit slip ('1 KiB' for '1 GiB'). On `device = "cpu"` the
meter enforces a limit of any size (a small model's step fits in kilobytes)."""


def check_device_memory(value: int | str | None, device: str) -> int | str | None:
    """A parsed `device_memory` (`parse_device_memory`) for `device` (the file's `device` setting), refused
    below `MIN_DEVICE_MEMORY` unless the device is the CPU."""
    if isinstance(value, int) and value < MIN_DEVICE_MEMORY and device != "cpu":
        raise ValueError(
            f"device_memory {value:,} B is below 1 MiB, less than any GPU gives a training step (PyTorch's CUDA "
            f"allocator reserves at least 2 MiB for the first tensor), so most likely a unit slip; give the device's "
            f"memory with its unit (e.g. '16 GiB'), or set device = \"cpu\", where the meter enforces a limit of any "
            f"size")
    return value


def parse_device_memory_text(text: str, device: str) -> int | str | None:
    """`device_memory` written on the command line for a run on `device`, read as the TOML value it would be
    (`17179869184`, `16GiB`) and checked as the file's."""
    return check_device_memory(parse_device_memory(_toml_value(text)), device)


MAX_OVERHEAD = 10.0
"""The largest `max_overhead` accepted: a schedule 11 times slower than no recomputation is a typo."""


def parse_max_overhead(value: Any) -> list[float]:
    """`max_overhead = 0.1` or `[0.05, 0.25]`: each a number in [0, 10], one plan each."""
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_OVERHEAD
                         for v in values):                    # NaN fails the comparison too
        raise ValueError(
            "max_overhead must be a number or a non-empty list of numbers in [0, 10], the predicted step-time "
            "overhead allowed over the no-recomputation schedule as a fraction (0.10: at most 10% slower); "
            "write e.g. max_overhead = 0.10 or max_overhead = [0.05, 0.25]")
    return [float(v) for v in values]


def _eager_fraction(value: str, percent: str) -> float:
    """The fraction of eager's peak that `value` ("50% eager", its number `percent`) asks for, in (0, 10]."""
    try:
        fraction = float(Decimal(percent) / 100)
    except ArithmeticError:
        raise ValueError(f"budget {value!r} is not understood: {percent!r} is not a number; write a percentage of "
                         "eager PyTorch's measured peak such as '50% eager'") from None
    if not 0 < fraction <= MAX_EAGER_FRACTION:
        raise ValueError(f"budget {value!r} asks for {percent}% of eager PyTorch's measured peak; a fraction of "
                         f"eager's peak must lie above 0% and at most {MAX_EAGER_FRACTION:.0%} (e.g. '50% eager')")
    return fraction


def _budget_help(value: Any) -> str:
    return (
        f"budget {value!r} is not understood; write an integer number of bytes (2000000000), a size "
        f"with a unit ('1.5 GiB', '512 MiB'; units {', '.join(_UNITS)}), or a fraction of the "
        "checkpoint-all peak as a float in (0, 1] (0.6) or a percentage ('60%'), or a percentage of eager "
        "PyTorch's measured peak ('50% eager'); byte budgets lie in "
        f"1..{MAX_BUDGET_BYTES}"
    )

"""Budget parsing at its edges: every unit, the bounds of each form, command-line text read as TOML, and
the error paragraph."""

from __future__ import annotations

import pytest

from memplan.tasks.config import MAX_BUDGET_BYTES, Budget, parse_budget, parse_budget_text, parse_option_text


@pytest.mark.parametrize("text, nbytes", [
    ("1 b", 1), ("3 kB", 3000), ("3 KiB", 3072), ("2 mb", 2 * 10**6), ("2 MIB", 2 * 2**20), ("1 gb", 10**9),
    ("1 gib", 2**30), (" 7 B ", 7), ("2.5 KiB", 2560), ("1.", None), ("4e2 B", 400), ("1E1B", 10),
    ("0.5 B", None), ("0 B", None), ("8 EiB", None), ("1 TB", None), ("1.5", None), ("B", None),
])
def test_sizes_with_units(text, nbytes):
    if nbytes is None:
        with pytest.raises(ValueError, match="is not understood"):
            parse_budget(text)
    else:
        assert parse_budget(text) == Budget(bytes=nbytes)


@pytest.mark.parametrize("value, fraction", [
    ("100%", 1.0), ("0.5%", 0.005), (" 60 % ", 0.6), ("100.0%", 1.0), ("100.1%", None), ("0%", None),
    ("-5%", None), ("%", None), (1e-9, 1e-9), (1.0, 1.0), (1.0000001, None), (0.0, None), (-0.5, None),
])
def test_fractions_lie_in_0_to_1(value, fraction):
    if fraction is None:
        with pytest.raises(ValueError, match="is not understood"):
            parse_budget(value)
    else:
        assert parse_budget(value) == Budget(fraction=pytest.approx(fraction))


@pytest.mark.parametrize("value, ok", [(1, True), (0, False), (-1, False), (MAX_BUDGET_BYTES, True),
                                       (MAX_BUDGET_BYTES + 1, False), (True, False), (False, False)])
def test_byte_integers_lie_in_1_to_2_63_minus_1(value, ok):
    if ok:
        assert parse_budget(value) == Budget(bytes=value)
    else:
        with pytest.raises(ValueError, match="is not understood"):
            parse_budget(value)


def test_sizes_above_the_largest_budget_are_refused():
    assert parse_budget("8 GiB").bytes == 8 * 2**30
    with pytest.raises(ValueError):
        parse_budget(f"{2**63} B")
    assert parse_budget(f"{2**62} B") == Budget(bytes=2**62)


@pytest.mark.parametrize("value", [None, [1], {"a": 1}, b"1 GiB"])
def test_other_types_are_refused(value):
    with pytest.raises(ValueError, match="is not understood"):
        parse_budget(value)


def test_the_error_names_the_value_every_form_and_the_byte_range():
    with pytest.raises(ValueError) as err:
        parse_budget("lots")
    assert str(err.value) == (
        "budget 'lots' is not understood; write an integer number of bytes (2000000000), a size with a unit "
        "('1.5 GiB', '512 MiB'; units b, kb, mb, gb, kib, mib, gib), or a fraction of the checkpoint-all peak "
        "as a float in (0, 1] (0.6) or a percentage ('60%'), or a percentage of eager PyTorch's measured peak "
        "('50% eager'); byte budgets lie in 1..9223372036854775807")


@pytest.mark.parametrize("text, expected", [
    ("2000000000", Budget(bytes=2_000_000_000)), ("0.8", Budget(fraction=0.8)), ("80%", Budget(fraction=0.8)),
    ("1.5GiB", Budget(bytes=3 * 2**29)), ('"60%"', Budget(fraction=0.6)), ("1", Budget(bytes=1)),
])
def test_command_line_budgets_read_as_toml_values(text, expected):
    assert parse_budget_text(text) == expected


@pytest.mark.parametrize("assignment, expected", [
    ("mode=memory", ("mode", "memory")), ('mode="memory"', ("mode", "memory")), (" keep = [1, 2] ", ("keep", [1, 2])),
    ("gap=0.1", ("gap", 0.1)), ("x=a=b", ("x", "a=b")), ("flag=true", ("flag", True)),
])
def test_options_read_as_toml_values(assignment, expected):
    assert parse_option_text(assignment) == expected


@pytest.mark.parametrize("assignment", ["mode", "=memory", " =1"])
def test_options_without_a_key_are_refused(assignment):
    with pytest.raises(ValueError, match=f"option {assignment!r} is not KEY=VALUE"):
        parse_option_text(assignment)


@pytest.mark.parametrize("budget, peak, expected", [
    (Budget(fraction=0.5), 1001, 500), (Budget(fraction=1.0), 7, 7), (Budget(bytes=123), 10**9, 123),
    (Budget(fraction=0.93), 100, 93),
])
def test_resolution(budget, peak, expected):
    assert budget.resolve(peak) == expected


@pytest.mark.parametrize("budget, label", [
    (Budget(fraction=0.7), "70pct"), (Budget(fraction=0.935), "93.5pct"), (Budget(fraction=1.0), "100pct"),
    (Budget(bytes=1024), "1024B"),
])
def test_labels(budget, label):
    assert budget.label == label


@pytest.mark.parametrize("value", [True, 0, MAX_BUDGET_BYTES + 1, 1.5, 0.0, "0 B"])
def test_the_error_names_the_refused_value_of_every_type(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    assert str(err.value).startswith(f"budget {value!r} is not understood")


@pytest.mark.parametrize("text, nbytes", [
    (f"{MAX_BUDGET_BYTES} B", MAX_BUDGET_BYTES), (f"{2**53 + 1} B", 2**53 + 1), ("8589934591.999999999 GiB", MAX_BUDGET_BYTES - 1),
    (f"{MAX_BUDGET_BYTES + 1} B", None), ("1e9999 B", None), ("1e99999 B", None),
])
def test_sizes_are_exact_up_to_the_largest_budget(text, nbytes):
    """Sizes are computed without float rounding (a float would refuse the largest budget and round
    2**53 + 1 bytes down); a huge exponent is refused at once."""
    if nbytes is None:
        with pytest.raises(ValueError, match="is not understood"):
            parse_budget(text)
    else:
        assert parse_budget(text) == Budget(bytes=nbytes)

"""The one quantity parser (gputopo.quantity), property-tested against the Kubernetes quantity grammar: every
string the grammar produces parses to its exact value, computed here independently with fractions."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.podspec import PodSpecError, pod_device_count
from gputopo.quantity import QuantityError, device_count, parse_quantity

DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY_SI = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
digits = st.text("0123456789", min_size=1, max_size=12)


@st.composite
def numbers(draw: st.DrawFn) -> tuple[str, Fraction]:
    """<signedNumber> and its value: <digits> | <digits>.<digits> | <digits>. | .<digits>, optionally signed."""
    sign = draw(st.sampled_from(["", "+", "-"]))
    form = draw(st.sampled_from(["int", "int.frac", "int.", ".frac"]))
    whole = draw(digits) if form != ".frac" else ""
    frac = draw(digits) if form in ("int.frac", ".frac") else ""
    text = whole + ("." if form != "int" else "") + frac
    value = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    return sign + text, -value if sign == "-" else value


@st.composite
def quantities(draw: st.DrawFn) -> tuple[str, Fraction]:
    """<quantity> ::= <signedNumber><suffix>, and its exact value."""
    text, value = draw(numbers())
    kind = draw(st.sampled_from(["decimalSI", "binarySI", "exponent"]))
    if kind == "decimalSI":
        suffix = draw(st.sampled_from(sorted(DECIMAL_SI)))
        return text + suffix, value * Fraction(10) ** DECIMAL_SI[suffix]
    if kind == "binarySI":
        suffix = draw(st.sampled_from(sorted(BINARY_SI)))
        return text + suffix, value * 2 ** BINARY_SI[suffix]
    exponent = draw(st.integers(-40, 40))
    sign = "+" if exponent >= 0 and draw(st.booleans()) else ""
    return f"{text}{draw(st.sampled_from('eE'))}{sign}{exponent}", value * Fraction(10) ** exponent


@given(quantities(), st.sampled_from(["", " ", "\t"]))
def test_every_form_of_the_grammar_parses_to_its_value(case: tuple[str, Fraction], pad: str) -> None:
    text, value = case
    assert Fraction(parse_quantity(pad + text + pad)) == value


@given(quantities())
def test_device_counts_are_whole_non_negative_and_bounded(case: tuple[str, Fraction]) -> None:
    text, value = case
    if value < 0 or value.denominator != 1 or value > 4096:
        with pytest.raises(QuantityError):
            device_count(text, 4096)
    else:
        assert device_count(text, 4096) == value


@pytest.mark.parametrize(("text", "count"), [
    ("1e0", 1), ("8e0", 8), ("2e3", 2000), ("8E0", 8), ("80e-1", 8), ("+4", 4), ("4.", 4), ("4.000", 4),
    ("4000m", 4), ("1k", 1000), ("1Ki", 1024), ("0.004k", 4), ("4000000000n", 4), ("0e999999", 0), (" 2 ", 2),
])
def test_decimal_exponents_and_the_other_forms(text: str, count: int) -> None:
    assert device_count(text, 4096) == count


@pytest.mark.parametrize("text", ["", ".", "+", "e3", "1e", "1e1.5", "1 k", "1KI", "1ki", "0x10", "1,5", "1e+",
                                  "1.2.3", "--1", "1Mb", "١", "1" * 300])
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize(("value", "problem"), [("1.00000000000000000000000000000001", "whole"), ("-1", "whole"),
                                                ("1e30", "beyond"), (1.5, "whole"), (True, "not a number")])
def test_counts_that_no_device_count_can_be(value: object, problem: str) -> None:
    with pytest.raises(QuantityError, match=problem):
        device_count(value, 4096)


def test_pod_count_uses_the_parser_and_refuses_repeated_container_names() -> None:
    res = "nvidia.com/gpu"
    pod = {"spec": {"initContainers": [{"name": "init", "resources": {"limits": {res: "2e0"}}}],
                    "containers": [{"name": "a", "resources": {"limits": {res: "1e0"}}},
                                   {"name": "b", "resources": {"requests": {res: "3000m"}}}]}}
    assert pod_device_count(pod, res) == 4
    pod["spec"]["containers"][1]["name"] = "init"
    with pytest.raises(PodSpecError, match="repeats the container name 'init'"):
        pod_device_count(pod, res)

"""Kubernetes resource quantities ("2", "2000m", "1k", "1Ki", "1e3", "+.5E-1"), parsed exactly.

The grammar (k8s.io/apimachinery resource.Quantity):

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>          <sign> ::= "+" | "-"
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>

Where the written grammar and the apiserver differ, this follows the apiserver: it reads the exponent with
strconv.ParseInt, so a fractional exponent ("1e1.5") is refused, and it accepts the n (nano) and u (micro) suffixes
the written grammar leaves out. Surrounding whitespace is ignored, as JSON decoding of a Quantity does.

One parser for both halves: the extender counts a pod's GPUs with it, the plugin decides which of its node's pods
hold GPUs with it, so a quantity means the same on both paths.
"""

from __future__ import annotations

import math
import re
from decimal import Context, Decimal
from typing import Any

_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_QUANTITY = re.compile(rf"({_NUMBER})(?:([KMGTPE]i)|[eE]([+-]?[0-9]+)|([numkMGTPE]?))")
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
# Exponents beyond this make a value no count can use (a whole device count is far below 10^100); capping them
# keeps a hostile "1e999999999" from costing a huge exact computation.
_MAX_EXPONENT = 100
MAX_TEXT = 256
# Exact arithmetic for every quantity this module accepts (at most MAX_TEXT digits, shifted at most _MAX_EXPONENT
# or 60 binary places): Decimal's default 28 digits would round "1.000...0001" to a whole 1.
_EXACT = Context(prec=MAX_TEXT + 2 * _MAX_EXPONENT, Emax=MAX_TEXT + 10 * _MAX_EXPONENT,
                 Emin=-MAX_TEXT - 10 * _MAX_EXPONENT)


class QuantityError(ValueError):
    """Not a Kubernetes quantity, or not one that can count devices; the message names where and what."""


def parse_quantity(text: str) -> Decimal:
    """The exact value of a quantity string. Raises QuantityError when it is not one."""
    if len(text) > MAX_TEXT:
        raise QuantityError(f"{text[:32]!r}... ({len(text)} characters) is not a Kubernetes quantity")
    m = _QUANTITY.fullmatch(text.strip())
    if m is None:
        raise QuantityError(f"{text!r} is not a Kubernetes quantity")
    number, binary, exponent, decimal = m.groups()
    value = Decimal(number)
    if binary is not None:
        return _EXACT.multiply(value, Decimal(2 ** _BINARY_SI[binary]))
    power = int(exponent) if exponent is not None else _DECIMAL_SI[decimal]
    if value == 0:
        return Decimal(0)
    power = max(-_MAX_EXPONENT, min(_MAX_EXPONENT, power))
    return value.scaleb(power, _EXACT)


def device_count(value: Any, most: int) -> int:
    """A whole, non-negative number of devices from a quantity string or a JSON number, at most `most`. Raises
    QuantityError (extended resources cannot be fractional)."""
    if isinstance(value, bool):
        raise QuantityError(f"quantity {value!r} is not a number")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float) and math.isfinite(value):
        number = Decimal(repr(value))
    elif isinstance(value, str):
        number = parse_quantity(value)
    else:
        raise QuantityError(f"quantity must be a string or number, got {type(value).__name__}")
    if number < 0 or number != number.to_integral_value():
        raise QuantityError(f"{value!r} is not a whole, non-negative number of devices")
    if number > most:
        raise QuantityError(f"{value!r} devices is beyond any node")
    return int(number)

"""The one place that decides which numbers the gateway may dial (transfers).

Flows are validated with it at load (literal numbers), the engine checks a rendered number
before it decides to transfer, and the ``<Connect action>`` handler checks the stored number
again before it answers ``<Dial>``: the same rule everywhere.
"""

from __future__ import annotations

import re
from typing import Final

E164: Final = re.compile(r"\+[1-9]\d{6,14}")
"""ITU-T E.164 with a leading '+': what Twilio's <Dial> and REST API accept unambiguously."""


def is_dialable(number: str) -> bool:
    """True when ``number`` is a full E.164 number (no spaces, no extension)."""
    return E164.fullmatch(number) is not None

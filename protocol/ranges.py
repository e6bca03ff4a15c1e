"""The ranges of numeric message fields, as msgspec ``Meta`` constraints checked at decode.

A value out of its range is a ``ValidationError`` at decode, which ``codec`` turns into
``invalid_message``: no handler ever sees a negative count, an infinite deadline or a NaN reward.
msgspec refuses NaN against any ``ge``/``le`` bound (every comparison with NaN is false), and refuses
+/-inf only against a finite bound on that side, so every float here has both bounds (``FLOAT_MAX``,
the largest finite float, where a field has no narrower one). These are static bounds; how far ahead
of *now* a deadline may be is the actor's check (``PARKWAY_MAX_DEADLINE_S``), since decoding has no clock.
"""

from __future__ import annotations

import sys
from typing import Annotated, Final

import msgspec

FLOAT_MAX: Final = sys.float_info.max
INT64_MAX: Final = 2**63 - 1
# Deadlines are absolute Unix seconds: 2**32 is in the year 2106, beyond any real deadline.
MAX_DEADLINE: Final = float(2**32)
# Token ids are vocabulary indices: never negative, and below any vocabulary a model has.
MAX_TOKEN_ID: Final = 2**31 - 1
# The largest generation and the most turns one message may ask for (a sender that can sign could
# otherwise ask a policy for 2**63 tokens or an agent for a billion turns).
MAX_TOKENS: Final = 1 << 20
MAX_TURNS: Final = 10_000

Deadline = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DEADLINE)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # counts, indices, attempts, steps, versions
Int64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]  # seeds: any 64-bit value
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
TokenBudget = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Turns = Annotated[int, msgspec.Meta(ge=0, le=MAX_TURNS)]
Finite = Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]  # rewards, measured values
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT_MAX)]  # durations and Unix times
LogProb = Annotated[float, msgspec.Meta(le=FLOAT_MAX)]  # -inf is a real log-probability (a masked token)

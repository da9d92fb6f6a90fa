"""Numbers and booleans in request bodies that take only their own JSON type.

pydantic's lax mode reads `true` as 1 for an int or float field, so
`"max_tokens": true` would run one token and `"tpm": true` would create a key
limited to one token a minute; it reads `1`, `"yes"` or `"off"` as a bool.
OpenAI's API answers such bodies with 400 and the OpenAPI schema says
integer, number or boolean, so stoker refuses them too. An integer field also
refuses `2.0` (a float once parsed); a number field takes `2`.

pydantic's Strict marker, not a validator wrapped around the type: field
constraints (ge, le) then stay on the number and appear in the schema as
minimum and maximum.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Strict

Integer = Annotated[int, Strict()]
Number = Annotated[float, Strict()]
Boolean = Annotated[bool, Strict()]

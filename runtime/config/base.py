"""What every config section shares: `Doc` for a field's description and the Struct options
(keyword-only, unknown keys refused, defaults written out)."""

from __future__ import annotations

from msgspec import Meta

Doc = Meta

STRUCT = dict(kw_only=True, forbid_unknown_fields=True, omit_defaults=False)

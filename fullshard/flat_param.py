"""``FlatParameter`` and its handle, under the path torch's tests and users import them from.

They live in the engine (``fullshard/_engine/flat_param.py``); this module only names them.
"""

from __future__ import annotations

from ._engine.flat_param import FlatParameter, FlatParamHandle, HandleState

__all__ = ["FlatParamHandle", "FlatParameter", "HandleState"]

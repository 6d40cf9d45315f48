"""The engine: units, their flat parameters and layout, the step's hooks and schedule (see
docs/architecture.md). It builds on ``fullshard._comm`` and never imports a front door."""

"""The error every parallel-layout check raises (``parallel.layout.validate_layout`` and the
per-technique checks beside each technique): one message naming the value, the rule and the fix,
reported by the job and the launcher in one line before any process group exists."""


class LayoutError(ValueError):
    """An impossible parallel layout, found before any process group is created."""

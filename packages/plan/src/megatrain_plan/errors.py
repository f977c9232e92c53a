"""The planner's exception: a run it refuses."""


class PlanError(Exception):
    """A run the planner refuses before anything is allocated, with the fix in the message."""

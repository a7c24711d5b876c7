"""The one error type loaders raise: what was wrong with the weights, and what is supported."""


class WeightsError(ValueError):
    """A model file or folder that cannot be loaded; the message names the file and the problem."""

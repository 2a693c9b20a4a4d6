"""Refit error types; every message names the rank, bucket or tensor involved."""

# Ends the message of a refit that failed before any engine worker loaded a byte of it (its
# status exchange says so): the engines still hold their last complete version intact.
NOTHING_LOADED = "nothing of it was loaded on any engine worker"
# Ends an engine's message of a refit that failed after loading some of it, when every one of
# its workers restored what it had applied (the undo log, `RefitConfig.undo_bytes`).
ROLLED_BACK = "every worker of this engine rolled back to its last complete version"


class RefitError(RuntimeError):
    """Base of every refit failure."""


class RefitCommError(RefitError):
    """A collective of the refit group failed or timed out (a peer died or hung).

    The group is unusable afterwards: destroy it and build a new one before the next refit.
    """


class PlanMismatchError(RefitError):
    """Ranks of the refit group hold different plans (raised on every rank at setup)."""


class TensorMismatchError(RefitError):
    """A tensor handed to the sender disagrees with its spec (name, shape or dtype drifted)."""


class FormatMismatchError(RefitError):
    """The engine's checkpoint format and the trainers' tensors disagree (an FP8 weight the
    trainers do not send, a tensor the engine holds in a format refit cannot produce, a scale
    of the wrong shape); raised at setup on every rank, naming the tensor."""


class RefitAborted(RefitError):
    """The refit did not land: a rank failed it, or the engines did not commit it (the message
    names who, and says when nothing of it was loaded)."""


class ConversionError(RefitError, LookupError):
    """No conversion is known: a training tensor without a rule, a model type without a
    converter, or a plan tensor the model does not hold (the message names it)."""


class NeedsRefusedError(RefitError):
    """A worker's need report does not fit the plan (raised on every rank at the re-plan at a
    refit's start, naming the worker; nothing was sent). `ranks`: the refused workers."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks

"""Which Number Token Loss a call computes, and how strongly: the four settings every loss entry point and every
output head shares. A recipe's `loss.ntl` section (`config.recipe.NtlConfig`) has the same fields and is passed
where a spec is asked for."""

from dataclasses import dataclass


@dataclass(frozen=True)
class NtlSpec:
    kind: str | None = "was"
    """was|mse|mae|huber|digits|number, or None for cross-entropy alone (`ce_ntl_loss` says what each computes)."""
    weight: float = 0.3
    """λ in CE + λ·NTL."""
    reweigh: bool = False
    """Weigh each position's NTL by its class's value range (single-token kinds but digits)."""
    float_level: bool = False
    """Kind number: one decimal point may join two runs of number labels into one number."""

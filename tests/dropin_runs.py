"""A spy on the drop-in's runs of our loop (tests of ``dflash.apply``)."""

from dflash.decoding import hf as dropin


def spy(monkeypatch) -> list:
    """The methods our loop ran for drop-in calls, in order (a fallback to transformers' generate adds nothing)."""
    calls = []
    real = dropin.run_generation

    def run(*a, **k):
        calls.append(k.get("method"))
        return real(*a, **k)

    monkeypatch.setattr(dropin, "run_generation", run)
    return calls

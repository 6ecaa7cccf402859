"""Statistics over seeds: intervals, windows and curves, power, the confirmatory design, collapse, the held-out gain,
fits, regimes, strata and verdicts; nothing here names a claim."""

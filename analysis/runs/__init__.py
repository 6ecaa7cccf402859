"""Reading runs: run directories into a study's tidy tables (tidy, rundir, columns), finding a study's results,
choosing its runs (select), the registry's names and the metric vocabulary."""

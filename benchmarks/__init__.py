"""Every benchmark, imported as `workbench_benchmarks`; each prints side-by-side ratios and writes JSON
with its environment. Run them through `workbench bench WHAT`."""

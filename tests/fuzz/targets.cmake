# The fuzz targets, tests/fuzz/<name>.cpp each, with corpus/<name>, regressions/<name> and pending/<name>.
set(PACER_FUZZ_NAMES tar pidx dirindex idx manifest profile baseline steps tokenize curate)

"""The experiments' named data sets: where to find them (offline first) and how the papers
split them. The generic format readers they use (IDX, LIBSVM) and the synthetic streams are
library (:mod:`flwr_corrnoise.data`)."""

"""The seekable block format: a filesystem image cut into sectors, each compressed and digested."""

"""Every other family of `models.FAMILIES` from the second (`families.py` has the checks), compiled through
torch.export, against transformers. The table is split over two files so that pytest-xdist's workers share it."""

from __future__ import annotations

from families import family_tests
from models import FAMILIES

# Every other family: the windowed ones spread over both files.
TestFamilies = family_tests(list(FAMILIES)[1::2])

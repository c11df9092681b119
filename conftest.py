"""Names the docstring examples use without importing (`--doctest-modules`)."""

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    import keras
    from keras import ops

    doctest_namespace.update(np=np, keras=keras, ops=ops)

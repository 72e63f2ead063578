"""Import pagedkv before any test module imports triton.

``pagedkv`` sets ``TRITON_INTERPRET=1`` on a machine without a GPU, and Triton
reads it when a function is decorated -- including its own ``tl.sum`` and
``tl.max``, decorated when ``triton.language`` is first imported. A test module
that imports triton first would leave those compiled-mode functions behind for
every later test, whatever order pytest collects the files in.
"""

import pagedkv  # noqa: F401

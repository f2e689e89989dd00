"""The demo application built on the compiler: the ``spmd-expand`` command (``cli``), the training job
(``train``: a character-level GPT on real text, ``models``, ``data``, ``presets``), and the local
launcher that spawns gloo ranks without ``torchrun`` (``launch``; the test suite uses it too).

Nothing in the compiler (``spmd_expand/*.py``, ``spmd_expand.passes``) imports from here.
"""

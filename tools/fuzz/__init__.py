"""Coverage-guided fuzzing (atheris) of everything that reads untrusted input.

A reader who serves their own model hands the library files from a model hub
(GGUF, config.json + safetensors), a chat template inside them, and arguments
to ``SamplingParams``, ``LLM.generate`` and ``LLM.chat``. The contract every
target enforces (``contract.py``): an input either loads or raises the
documented ``ValueError``/``TypeError`` naming the file or argument; no other
exception escapes; it finishes within 1 s of CPU time; the process stays under
a 2 GiB address-space limit.

    python -m tools.fuzz run gguf --seconds 600      # one target (atheris / libFuzzer)
    python -m tools.fuzz replay                      # every committed corpus input, once
    python -m tools.fuzz seeds                       # rewrite the seed inputs of the corpus

Targets (``targets.py``): ``gguf``, ``pretrained``, ``tokenizer``, ``sampling``.
The committed corpus (``corpus/<target>/``) holds the seeds (``seed-*``,
small valid files), hand-written hostile GGUF headers (``hostile-*``), every
input the fuzzer found to break the contract (``crash-*``, with its fix in the
library), and inputs a campaign kept for coverage (``cov-*``);
``tools/tests/test_fuzz_corpus.py`` replays it in ``make test``.
"""

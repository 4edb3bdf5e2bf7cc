"""Layer engines (llama.cpp, MLX) and the sessions they hold.

Public surface: ``node.engine`` (the ``LayerEngine`` contract, ``BatchItem``,
``StageOutput``, ``EngineConfig``), ``node.engines`` (``resolve_engine``, ``load_engine``:
which engine and building it), ``node.llamacpp_engine.LlamaCppEngine``,
``node.mlx_engine.MlxEngine`` (needs mlx), ``node.tokenizer.Tokenizer``, ``node.errors``.
"""

import os

# llama.cpp's CPU backend here is built with OpenMP, whose worker threads spin while waiting
# at barriers. A peer shares its machine (with its owner, and in a local swarm with other
# peers), and spinning threads that lose their core turn a 40 tok/s decode into 2 tok/s.
# Passive waiting costs a few percent when the machine is idle. Must be set before
# libgomp loads, i.e. before the first ``import llama_cpp``; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

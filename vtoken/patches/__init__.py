"""patches/ tooling: the manifest of upstream (vLLM) symbols vToken depends on.

This package is tooling (it imports vLLM); the engine-independent core never imports it.
Entries live in ``patches/entries/<symbol>.toml``; ``patches/README.md`` is generated.

Commands (``python -m vtoken.patches ...``):

* ``check [--entries DIR] [--scan FILE ...] [--no-default-scan]``: exit 1, naming each
  symbol, when a fingerprint differs, a symbol is gone, or the code touches an upstream
  symbol without an entry.
* ``rebase --python OTHER [--entries DIR]``: per symbol unchanged / changed (with a
  unified diff of the upstream source) / gone, against the vLLM installed under OTHER.
* ``report (--python OTHER | --from-json F) [--verdicts V] [--out MD] [--save-json F]``:
  the same comparison as a Markdown report, ``patches/rebase-<version>.md``, with a verdict
  per changed symbol (automatic ``cosmetic`` when the ASTs prove it, else hand-written in
  ``patches/rebase-verdicts-<version>.toml``, else ``needs review``, exit 1); what
  ``make rebase-check VLLM=x.y.z`` runs. See ``vtoken/patches/report.py``.
* ``update [--python OTHER]``: rewrite fingerprints and ``upstream_version`` after a
  deliberate rebase; regenerates the index.
* ``index [--check]``: write (or verify) ``patches/README.md``.
* ``add SYMBOL --kind K --why W --change C [--source-of S] [--used-by U ...]``: new entry
  (fingerprinted here; regenerates the index).
"""

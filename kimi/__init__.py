"""The model's files: what a Kimi-Linear checkpoint is and how it is read and written, with every
input from outside (config.json, safetensors headers, tokenizer files, index files) validated before
use. Bits only: the float64 math is ``reference``'s, which builds on this package.

- ``config``: ``KimiConfig``, its presets and its config.json (``ConfigError``);
- ``tensors``: the tensor table of a checkpoint (names, shapes, storage dtypes);
- ``checkpoint``: ``WeightSource``, ``open_source`` (safetensors, read lazily) and ``save_checkpoint``;
- ``safetensors_format``: the safetensors header, validated; ``validate``: the checks of untrusted JSON;
- ``storage``: storage bit conversions and the one host thread pool (NumPy only);
- ``synthetic``: ``SyntheticSource``, weights generated from a seed; ``fixtures``: synthetic
  checkpoints on disk and the bundled default;
- ``tokenizer``: the checkpoint's tokenizer (bytes, or tiktoken when installed).

It imports NumPy only (tiktoken where a checkpoint asks for it), and nothing of the project."""

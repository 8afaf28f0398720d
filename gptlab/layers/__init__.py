"""The teaching code: one layer per file, a ``<name>_forward`` / ``<name>_backward`` pair
(docs/CONVENTIONS.md, "Layer contract"), each derived in the book and gradient-checked.

May import: ``gptlab.backend`` and ``gptlab.checks``, and other layers (a block is made of
layers); never the model, training or anything above. The bottom of the package.
"""

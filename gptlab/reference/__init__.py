"""Independent torch autograd models: the oracle the hand-written backward is checked against.

May import: ``gptlab.config`` only, never the layers or the model it checks.
"""

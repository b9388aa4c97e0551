"""miserver: an inference server a trainer can attach to and write in place, behind a step barrier.

The four layers live inside this package (``spec``, ``fsm``, ``ipc``, ``http``, ``serving``); a
top-level ``http`` package would shadow the standard library's ``http`` module.
"""

__version__ = "0.1.0"

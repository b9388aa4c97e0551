"""Structured outputs and tool calls on ``/v1`` (issue 33): the request side.

- :mod:`~miserver.serving.structured.response_format`: ``response_format`` parsed and its JSON
  schema checked for the features miserver enforces (backend-independent), then compiled into
  a :class:`~miserver.serving.engine.constraints.Constraint` for a transformers resident, or
  a :class:`~miserver.serving.models.gguf.JsonSchemaGrammar` (llama.cpp's own grammar) for a
  GGUF resident.
- :mod:`~miserver.serving.structured.tools`: ``tools`` / ``tool_choice`` checked, rendered
  through the model's chat template, the tool-call grammar, and the output parsed into OpenAI
  ``tool_calls`` (whole, or as stream deltas).
"""

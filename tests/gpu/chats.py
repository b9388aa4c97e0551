"""The chat prompts the GPU tests of the engines decode (one list, shared)."""

CHATS = [
    "What is the capital of France?",
    "Hi",
    "Explain what a CUDA graph is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into German, French and Spanish, one per line.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "Summarise the plot of Hamlet in two sentences.",
]

"""The front end the CLI, the server and the batch job share: what a user gives becomes what the engine takes,
and what the engine gives back becomes what the user reads.

    prompts.py   text, token ids or chat messages (with tools) -> prompt ids
    params.py    request fields (flags, a batch line's params, a body's fields) -> SamplingParams
    results.py   a finished row -> its JSON record (`generate --json`, the batch job's lines)
    notices.py   the notices on stderr ([nanoinfer] ...), an answer cut short among them

Nothing here imports torch at module level, so the CLI's parser stays instant. The server's OpenAI-shaped
bodies are server/responses.py's: they are one protocol's, not shared.
"""

"""The client-facing gateway: the only endpoint a client of any topology talks to.

It checks what the router and the workers would otherwise see first or get wrong: the body
size (413 without reading past the limit), the prompt against the deployment's limit (counted
with the model's own tokenizer and chat template, the same rendering the server does), and
that every non-2xx reaching the client has its real status and an OpenAI-shaped JSON body.
Streams pass through chunk by chunk; a client disconnect closes the upstream request, which the
router and the workers turn into an abort.
"""

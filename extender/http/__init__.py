"""The HTTP face of the extender: the FastAPI app and its routers, request bodies and answers, the OpenAPI models of
kube-scheduler's JSON, and the uvicorn listener with its bounds. Nothing here decides a placement."""

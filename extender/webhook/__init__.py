"""The mutating admission webhook (`gpu-extender webhook`): pods that ask for the managed GPU resource and name no
scheduler of their own get the topology-aware scheduler's name, so nobody has to change their pods.

`review` decides (pure: an AdmissionReview request in, the answer out), `app` serves it over HTTPS, `certificates`
reloads a renewed serving certificate, `command` is the subcommand. Nothing here talks to the API server: the
webhook needs no RBAC (an import-linter contract keeps the Kubernetes client out).
"""

"""The Ray Serve replica: the deployment, its delta channel and logging. The only package of the engine
that imports Ray."""

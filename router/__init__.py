"""The HTTP ingress on Ray Serve, in layers, lowest first: the settings (``config.py``) <
``observability`` < ``routing`` (replica choice) < ``request`` (the request path) < ``lora`` <
``dispatch`` (running a request on the replicas) < ``response`` (the response path); on top,
``ingress.py`` (the app and its endpoints) and ``ray_compat.py``. ``tests/unit/test_layers.py``
checks the order."""

"""narad.cli: the ``narad`` command-line tool (a console script of the package).

It talks to any node over HTTP through the SDK (narad.client) and nothing else:
``narad.cli.main`` (the root group, global flags, credentials, errors, topic /
user / cluster / ctx / version / completion), ``narad.cli.messages`` (pub, sub,
replay), ``narad.cli.bench`` (load), ``narad.cli.contexts`` (saved contexts),
``narad.cli.fmt`` (durations and message rendering). Nothing in the server
imports it; it imports narad.client, narad (the version), click, msgspec and
the standard library.
"""

"""The client API: a sans-IO router, its handlers, and the HTTP/1.1 and HTTP/3 transports."""

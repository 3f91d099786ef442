"""naradctl: on-host administration over the control socket."""

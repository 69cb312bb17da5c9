"""Transfer engines: the mori.io binding, a loopback stand-in and the completion poller."""

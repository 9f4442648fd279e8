"""Communication: process groups and collectives (communicator), the control channel to the
daemon (control_client)."""

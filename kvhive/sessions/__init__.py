"""Context sessions and stored responses (torch-free): the registry of sessions and their
backends, the stored responses of ``/v1/responses`` and theirs."""

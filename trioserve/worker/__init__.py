"""The worker side: the sans-IO record codec (``protocol``: ``wire_records``, ``record_decoder``,
``wire_requests``), the transport over the child's pipes (``client``), the child process and its
exit status, one worker's admission and multiplexer (``runtime``, with the ``generation``
mailbox and the ``worker_link`` that serves one incarnation: dispatcher, reader, watchdog), the
supervisor (spawn, health, bounded kill, restart), several workers behind one router (``pool``,
``routing``) and the control-plane tokenizer for engines that take ids (``prompt_encoder``)."""

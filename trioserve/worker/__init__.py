"""The worker side: the sans-IO record codec (``protocol``), the transport over the child's pipes
(``client``), the child process and its exit status, one worker's admission and multiplexer
(``runtime``), the supervisor (spawn, health, bounded kill, restart), several workers behind one
router (``pool``, ``routing``) and the control-plane tokenizer for engines that take ids
(``prompt_encoder``)."""

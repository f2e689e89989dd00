"""Offline graph tools: ``spmd-expand dump`` (:mod:`.dump`) and ``spmd-expand diff`` (:mod:`.diff`),
over one text format (:mod:`.graph_text`), with an HTML picture (:mod:`.picture`)."""

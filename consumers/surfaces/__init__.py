"""Principal surfaces (DESIGN §4, spec 000 §9): the shared render model, the
terminal surface (``pgw surface``) and the browser surface's page server
(``pgw surface-web``). See docs/surfaces.md.
"""

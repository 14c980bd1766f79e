"""The runtime core: settings, pure policies, the adaptive estimator, the hook manager, metrics.

Imports nothing from FastDeploy and nothing from :mod:`fdsched.install`, :mod:`fdsched.patches` or the tools.
"""

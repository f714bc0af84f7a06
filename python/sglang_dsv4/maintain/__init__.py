"""What a maintainer of the distribution runs, not a server: the upstream trees and git
(`upstream`), the patch series (`export`, with `names` and `formatting`), and the verdict of each
fix on another upstream tree (`rebase_check`). Nothing here is imported by the plugin.
"""

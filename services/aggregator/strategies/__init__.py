"""The built-in server strategies, one per module, each written against fedmq's public Strategy contract.

They are found by name through fedmq.common.refs.STRATEGIES.
"""

"""The component runtime that the router and both workers share."""

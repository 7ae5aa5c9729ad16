"""The ground helpers every part uses, importing nothing else of substrax: pytrees (trees), a
PartitionSpec against a mesh (specs), the named scopes the steps write and the census reads
(scopes), what the layers declare they communicate (declared), the attributes a step sets on a
layer (hooks), each mesh axis's role in a step (roles)."""
